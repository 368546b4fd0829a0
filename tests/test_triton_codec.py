"""The Triton-facing parts on their own: the batch dimension of a request and of its
answer, compressed request bodies, and the documents of ``runtime.server.triton`` from
an engine that has not served yet (checked against Triton's own protobuf schema)."""

from __future__ import annotations

import gzip
import zlib

import numpy as np
import orjson
import pytest
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2, service_pb2

from runtime.api.config import BatchingConfig
from runtime.api.errors import ClientError, ModelError, RequestTooLarge, UnsupportedEncoding
from runtime.api.model import TensorSpec
from runtime.engine.engine import Engine
from runtime.models.toys import DoubleModel
from runtime.server import triton
from runtime.server.kserve import INFLATE_SLICE_BYTES, decoded_body, encode_infer, parse_infer

INPUTS = (TensorSpec("A", "FP32", (2,)), TensorSpec("B", "INT64", (-1,)))
OUTPUTS = (TensorSpec("Y", "FP32", (-1,)),)


def tensor(name: str, shape: list[int], datatype: str = "FP32"):
    return {"name": name, "shape": shape, "datatype": datatype,
            "data": list(range(int(np.prod(shape))))}


def parse(*inputs, encoding: str | None = None, raw: bytes | None = None):
    body = raw if raw is not None else orjson.dumps({"inputs": list(inputs)})
    return parse_infer(body, None, "m", INPUTS, OUTPUTS, 3, encoding)


def test_a_leading_dimension_on_every_input_makes_items_in_order():
    req = parse(tensor("A", [3, 2]), tensor("B", [3, 5], "INT64"))
    assert req.batch_size == 3 and req.batched and len(req.items) == 3
    np.testing.assert_array_equal(req.items[1]["A"], [2, 3])
    np.testing.assert_array_equal(req.items[2]["B"], [10, 11, 12, 13, 14])
    one = parse(tensor("A", [1, 2]), tensor("B", [1, 4], "INT64"))
    assert one.batch_size == 1 and one.items is None and one.inputs["A"].shape == (2,)
    plain = parse(tensor("A", [2]), tensor("B", [4], "INT64"))
    assert plain.batch_size is None and plain.items is None and not plain.batched


@pytest.mark.parametrize("inputs, fragment", [
    ((tensor("A", [3, 2]), tensor("B", [2, 4], "INT64")), "disagree on the batch size"),
    ((tensor("A", [3, 2]), tensor("B", [4], "INT64")), "['B'] have no batch dimension"),
    ((tensor("A", [0, 2]), tensor("B", [0, 4], "INT64")), "a batch of 0 items"),
    ((tensor("A", [3, 3]), tensor("B", [3, 4], "INT64")), "must have shape [2], or [k, 2]"),
])
def test_inconsistent_batches_are_client_errors(inputs, fragment):
    with pytest.raises(ClientError) as info:
        parse(*inputs)
    assert fragment in info.value.message and info.value.http_status == 400


def test_a_leading_one_on_some_inputs_only_stays_one_item():
    req = parse(tensor("A", [1, 2]), tensor("B", [4], "INT64"))
    assert req.batch_size is None and req.inputs["A"].shape == (2,)


def test_the_answer_stacks_the_items_outputs():
    req = parse(tensor("A", [2, 2]), tensor("B", [2, 3], "INT64"))
    results = [{"Y": np.array([1.0, 2.0], np.float32)}, {"Y": np.array([3.0, 4.0], np.float32)}]
    doc = orjson.loads(encode_infer("m", "1", req, results, OUTPUTS)[0])
    assert doc["outputs"] == [{"name": "Y", "datatype": "FP32", "shape": [2, 2],
                               "data": [1.0, 2.0, 3.0, 4.0]}]
    ragged = [{"Y": np.zeros(2, np.float32)}, {"Y": np.zeros(3, np.float32)}]
    with pytest.raises(ModelError, match=r"different shapes for the items of one request"):
        encode_infer("m", "1", req, ragged, OUTPUTS)


def test_compressed_bodies_inflate_in_every_accepted_form():
    body = b'{"inputs": []}' * 10
    raw = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    assert decoded_body(gzip.compress(body), "gzip") == body
    assert decoded_body(gzip.compress(body[:50]) + gzip.compress(body[50:]), "x-gzip") == body
    big = bytes(range(256)) * (3 * INFLATE_SLICE_BYTES // 256 + 7)  # inflated in four slices
    assert decoded_body(gzip.compress(big[:99]) + gzip.compress(big), "gzip") == big[:99] + big
    assert decoded_body(zlib.compress(body), "Deflate") == body
    assert decoded_body(raw.compress(body) + raw.flush(), "deflate") == body
    assert decoded_body(body, "identity") == body
    assert decoded_body(gzip.compress(zlib.compress(body)), "deflate, gzip") == body
    req = parse(raw=gzip.compress(orjson.dumps({"inputs": [tensor("A", [2]),
                                                           tensor("B", [1], "INT64")]})),
                encoding="gzip")
    np.testing.assert_array_equal(req.inputs["A"], [0, 1])


@pytest.mark.parametrize("data, encoding, error, fragment", [
    (gzip.compress(b"x" * 101), "gzip", RequestTooLarge, "more than this server accepts (100"),
    (zlib.compress(b"x" * 101), "deflate", RequestTooLarge, "inflates to more than"),
    (gzip.compress(b"{}")[:-4], "gzip", ClientError, "ends before its compressed stream"),
    (zlib.compress(b"{}") + b"junk", "deflate", ClientError, "4 bytes after its deflate stream"),
    (b"{}", "gzip", ClientError, "not valid gzip data"),
    (b"", "gzip", ClientError, "ends before"),
    (b"{}", "compress", UnsupportedEncoding, "'compress' is not supported"),
])
def test_bad_or_oversized_compressed_bodies_are_refused(data, encoding, error, fragment):
    with pytest.raises(error) as info:
        decoded_body(data, encoding, limit=100)
    assert fragment in info.value.message
    assert info.value.http_status == {RequestTooLarge: 413, UnsupportedEncoding: 415}.get(error, 400)
    assert decoded_body(gzip.compress(b"x" * 100), "gzip", limit=100) == b"x" * 100


# -- the documents of runtime.server.triton, from an engine that has not served yet -----------
def test_config_names_the_device_and_statistics_start_at_zero():
    cfg = BatchingConfig(max_batch_size=4, default_priority=0, priority_levels=2)
    gpu = Engine({"double": DoubleModel()}, {"double": cfg}, device="cuda:1")
    config = triton.model_config(gpu, "double")
    json_format.ParseDict(config, model_config_pb2.ModelConfig())
    assert config["instance_group"] == [{"name": "double_0", "kind": "KIND_GPU", "count": 1,
                                         "gpus": [1]}]
    assert config["dynamic_batching"]["default_priority_level"] == 1
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == 0  # work-conserving
    cpu = Engine({"double": DoubleModel()})
    assert triton.model_config(cpu, "double")["instance_group"][0]["kind"] == "KIND_CPU"
    stats = triton.model_statistics(cpu)
    json_format.ParseDict(stats, service_pb2.ModelStatisticsResponse())
    [doc] = stats["model_stats"]
    assert (doc["last_inference"], doc["inference_count"], doc["execution_count"]) == (0, 0, 0)
    assert doc["batch_stats"] == [] and doc["inference_stats"]["success"] == {"count": 0, "ns": 0}
    assert triton.repository_index(cpu) == [{
        "name": "double", "version": "1", "state": "UNAVAILABLE",
        "reason": "the model is loading or the server is stopping"}]
    assert triton.repository_index(cpu, ready_only=True) == []
