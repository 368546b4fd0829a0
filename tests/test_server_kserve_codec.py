"""The KServe v2 codec on its own: request decoding, checks, response encoding."""

from __future__ import annotations

import asyncio

import numpy as np
import orjson
import pytest

from runtime.api.errors import ClientError, ValidationError
from runtime.api.model import TensorSpec
from runtime.engine.engine import Engine
from runtime.models.toys import DoubleModel
from runtime.server.kserve import encode_infer, parse_infer, run_infer, submit_infer

INPUTS = (TensorSpec("INPUT0", "FP32", (4,)),)
OUTPUTS = (TensorSpec("OUTPUT0", "FP32", (2,)),)
TOKENS = (TensorSpec("IDS", "INT64", (-1,)),)


def body(inputs, **extra) -> bytes:
    return orjson.dumps({"inputs": inputs, **extra})


def fp32(data, shape=(4,), name="INPUT0", datatype="FP32"):
    return {"name": name, "shape": list(shape), "datatype": datatype, "data": data}


def parse(raw: bytes, specs=INPUTS, header: str | None = None, levels: int = 3):
    return parse_infer(raw, header, "m", specs, OUTPUTS, levels)


def test_flat_and_nested_data_decode_to_the_same_array():
    flat = parse(body([fp32([1, 2, 3, 4])]))
    nested = parse(body([fp32([[1, 2, 3, 4]], shape=(1, 4))]))
    assert flat.inputs["INPUT0"].dtype == np.float32
    np.testing.assert_array_equal(flat.inputs["INPUT0"], [1, 2, 3, 4])
    np.testing.assert_array_equal(nested.inputs["INPUT0"], [1, 2, 3, 4])
    assert not flat.batched and nested.batched


def test_variable_dimension_accepts_any_length():
    req = parse(body([fp32(list(range(7)), shape=(7,), name="IDS", datatype="INT64")]), TOKENS)
    assert req.inputs["IDS"].shape == (7,) and req.inputs["IDS"].dtype == np.int64


@pytest.mark.parametrize("raw, fragment", [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "JSON object"),
    (body([]), "non-empty \"inputs\""),
    (body([fp32([1, 2, 3])]), "needs 4 values, data has 3"),
    (body([fp32([1, 2, 3, 4], shape=(2, 2))]), "must have shape [4]"),
    (body([fp32([1, 2, 3, 4], datatype="INT32")]), "must have datatype FP32, got INT32"),
    (body([fp32([1, 2, 3, 4], datatype="FLOAT")]), "datatype 'FLOAT' is not supported"),
    (body([fp32([1, 2, 3, 4], name="OTHER")]), "has no input(s) ['OTHER']"),
    (body([fp32(["a", "b", "c", "d"])]), "not a (rectangular) list of FP32"),
    (body([{"name": "INPUT0", "shape": [4], "datatype": "FP32"}]), "has no 'data'"),
    (body([fp32([1, 2, 3, 4], shape=(-4,))]), "non-negative integers"),
    (body([fp32([1, 2, 3, 4])], parameters={"priority": "high"}), "priority='high' must be an integer"),
    (body([fp32([1, 2, 3, 4])], parameters={"timeout": -5}), "timeout=-5"),
    (body([fp32([1, 2, 3, 4])], parameters={"realtime": "yes"}), "realtime='yes'"),
    (body([fp32([1, 2, 3, 4])], outputs=[{"name": "NOPE"}]), "unknown output 'NOPE'"),
    (body([fp32([1, 2, 3, 4])], outputs=[{"name": "OUTPUT0"}, {"name": "OUTPUT0"}]),
     "output 'OUTPUT0' is asked for more than once"),
])
def test_malformed_requests_are_client_errors_naming_the_problem(raw, fragment):
    with pytest.raises(ClientError) as info:
        parse(raw)
    assert fragment in info.value.message
    assert info.value.http_status == 400


def test_missing_input_names_what_the_model_needs():
    two = INPUTS + (TensorSpec("MASK", "BOOL", (4,)),)
    with pytest.raises(ClientError, match=r"needs input 'MASK' \(BOOL, shape \[4\]\)"):
        parse(body([fp32([1, 2, 3, 4])]), two)


def test_priority_follows_the_schedule_policy_extension():
    assert parse(body([fp32([0] * 4)], parameters={"priority": 1})).priority == 0
    assert parse(body([fp32([0] * 4)], parameters={"priority": 3})).priority == 2
    assert parse(body([fp32([0] * 4)], parameters={"priority": 0})).priority is None
    with pytest.raises(ValidationError, match="priority 4 is out of range: send 1"):
        parse(body([fp32([0] * 4)], parameters={"priority": 4}))


def test_timeout_is_microseconds_and_bypass_flags():
    req = parse(body([fp32([0] * 4)], parameters={"timeout": 2500, "realtime": True}))
    assert req.timeout_ms == 2.5 and req.bypass
    assert parse(body([fp32([0] * 4)], parameters={"timeout": 0, "bypass": False})).timeout_ms is None


def test_binary_inputs_and_outputs_round_trip():
    x = np.arange(4, dtype=np.float32)
    head = orjson.dumps({"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32",
                                     "parameters": {"binary_data_size": 16}}],
                         "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}}],
                         "id": "r1"})
    req = parse(head + x.tobytes(), header=str(len(head)))
    np.testing.assert_array_equal(req.inputs["INPUT0"], x)
    assert req.inputs["INPUT0"].flags.writeable
    out = np.array([0.5, -1.0], dtype=np.float32)
    payload, headers = encode_infer("m", "1", req, {"OUTPUT0": out}, OUTPUTS)
    n = int(headers["Inference-Header-Content-Length"])
    doc = orjson.loads(payload[:n])
    assert doc["id"] == "r1" and doc["outputs"][0]["shape"] == [1, 2]
    assert doc["outputs"][0]["parameters"]["binary_data_size"] == 8
    np.testing.assert_array_equal(np.frombuffer(payload[n:], dtype=np.float32), out)


def test_binary_size_mismatch_is_reported():
    head = orjson.dumps({"inputs": [{"name": "INPUT0", "shape": [4], "datatype": "FP32",
                                     "parameters": {"binary_data_size": 12}}]})
    with pytest.raises(ClientError, match="needs 16 bytes, binary_data_size is 12"):
        parse(head + b"\0" * 12, header=str(len(head)))
    with pytest.raises(ClientError, match="Inference-Header-Content-Length"):
        parse(head, header="abc")


def test_json_response_has_flat_data_and_declared_datatype():
    req = parse(body([fp32([0] * 4)], id=7))
    payload, headers = encode_infer("m", "1", req, {"OUTPUT0": np.array([1.5, 2.0], np.float32)},
                                    OUTPUTS)
    assert headers == {}
    assert orjson.loads(payload) == {"model_name": "m", "model_version": "1", "id": "7",
                                     "outputs": [{"name": "OUTPUT0", "datatype": "FP32",
                                                  "shape": [2], "data": [1.5, 2.0]}]}


def test_bytes_tensors_in_json_and_binary():
    specs = (TensorSpec("TEXT", "BYTES", (2,)),)
    req = parse_infer(body([{"name": "TEXT", "shape": [2], "datatype": "BYTES",
                             "data": ["ab", "c"]}]), None, "m", specs, specs, 3)
    assert list(req.inputs["TEXT"]) == [b"ab", b"c"]
    blob = b"".join(len(s).to_bytes(4, "little") + s for s in (b"xy", b""))
    head = orjson.dumps({"inputs": [{"name": "TEXT", "shape": [2], "datatype": "BYTES",
                                     "parameters": {"binary_data_size": len(blob)}}]})
    req = parse_infer(head + blob, str(len(head)), "m", specs, specs, 3)
    assert list(req.inputs["TEXT"]) == [b"xy", b""]


def test_one_item_and_a_batch_of_items_reach_the_engine_the_same_way_in_both_forms():
    """``run_infer`` and ``submit_infer`` send one item through ``Engine.infer`` and a
    batch dimension of k through ``Engine.infer_items`` (the toy model refuses a whole
    [k, 4] array), and both forms answer alike."""
    model = DoubleModel()
    specs, outputs = model.inputs, model.outputs
    one = parse_infer(body([fp32([1, 2, 3, 4])]), None, "double", specs, outputs, 3)
    three = parse_infer(body([fp32([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]],
                                   shape=(3, 4))]), None, "double", specs, outputs, 3)
    assert one.items is None and len(three.items) == 3

    async def both(req) -> tuple[bytes, bytes]:
        engine = Engine({"double": model})
        await engine.start()
        try:
            awaited = await run_infer(engine, "double", req)
            answer: asyncio.Future = asyncio.get_running_loop().create_future()
            submit_infer(engine, "double", req,
                         lambda result, error: answer.set_result((result, error)))
            called, error = await asyncio.wait_for(answer, 10.0)
            assert error is None, error
        finally:
            await engine.stop()
        return (encode_infer("double", "1", req, awaited, outputs)[0],
                encode_infer("double", "1", req, called, outputs)[0])

    awaited, called = asyncio.run(both(one))
    assert awaited == called
    assert orjson.loads(awaited)["outputs"][0] == {"name": "OUTPUT0", "datatype": "FP32",
                                                   "shape": [4], "data": [2, 4, 6, 8]}
    awaited, called = asyncio.run(both(three))
    assert awaited == called
    out = orjson.loads(awaited)["outputs"][0]
    assert out["shape"] == [3, 4] and out["data"] == [2.0 * v for v in range(1, 13)]
    assert sum(model.batch_sizes) == 2 + 2 * 3  # one item twice, then three items twice
