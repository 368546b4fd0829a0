"""The gRPC codec and its protocol, without a server: requests built with
``tritonclient.grpc``'s own messages (sent as bytes, as on the wire), decoded by
``runtime.server.grpc.tensors`` from this server's private descriptor pool.

Also: the committed descriptor set is what the committed ``.proto`` files compile to,
Triton's messages carry KServe's ``grpc_predict_v2.proto`` fields unchanged, and the
private pool does not clash with tritonclient's registration of the same names.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import grpc
import numpy as np
import pytest
from tritonclient.grpc import InferResult, service_pb2

from runtime.api.errors import (ClientError, ModelNotFound, QueueFull, RequestExpired,
                                ShuttingDown, ValidationError)
from runtime.api.model import TensorSpec
from runtime.server.grpc import protocol
from runtime.server.grpc.protocol import PROTOS, load_pool, message
from runtime.server.grpc.status import refusal
from runtime.server.grpc.tensors import CONTENTS_FIELD, decode_request, encode_response

VEC = (TensorSpec("INPUT0", "FP32", (4,)),)
OUT = (TensorSpec("OUTPUT0", "FP32", (4,)),)
ModelInferRequest = message("ModelInferRequest")


def wire(triton_request: service_pb2.ModelInferRequest):
    """tritonclient's request as this server receives it."""
    return ModelInferRequest.FromString(triton_request.SerializeToString())


def tensor(request, name: str, datatype: str, shape: list[int]):
    t = request.inputs.add()
    t.name, t.datatype = name, datatype
    t.shape.extend(shape)
    return t


def decode(request, specs=VEC, outputs=OUT, levels: int = 3):
    return decode_request(wire(request), "m", specs, outputs, levels)


# -- the protocol --------------------------------------------------------------------
def test_our_messages_are_not_tritonclients_but_speak_the_same_bytes():
    assert ModelInferRequest is not service_pb2.ModelInferRequest
    assert ModelInferRequest.DESCRIPTOR.file.pool is protocol.POOL
    r = service_pb2.ModelInferRequest(model_name="mlp", id="7")
    tensor(r, "INPUT0", "FP32", [1, 4]).contents.fp32_contents.extend([1, 2, 3, 4])
    r.parameters["priority"].uint64_param = 2
    ours = wire(r)
    assert ours.inputs[0].contents.fp32_contents == [1, 2, 3, 4]
    assert ours.SerializeToString(deterministic=True) == r.SerializeToString(deterministic=True)


def test_every_kserve_v2_message_is_wire_identical_in_the_served_protocol():
    kserve = load_pool(PROTOS / "kserve_predict_v2.binpb")
    file = kserve.FindFileByName("grpc_predict_v2.proto")
    checked = 0

    def same(kserve_msg, ours_msg):
        nonlocal checked
        for field in kserve_msg.fields:
            mine = ours_msg.fields_by_number.get(field.number)
            assert mine is not None, f"{kserve_msg.full_name}.{field.name} missing"
            assert (mine.name, mine.type, mine.is_repeated) == \
                (field.name, field.type, field.is_repeated), kserve_msg.full_name
            checked += 1
        for nested in kserve_msg.nested_types:
            same(nested, ours_msg.nested_types_by_name[nested.name])

    for name, kserve_msg in file.message_types_by_name.items():
        same(kserve_msg, protocol.POOL.FindMessageTypeByName(f"inference.{name}"))
    kserve_service = file.services_by_name["GRPCInferenceService"]
    for method in kserve_service.methods:
        mine = protocol.SERVICE.methods_by_name[method.name]
        assert mine.input_type.name == method.input_type.name
        assert mine.output_type.name == method.output_type.name
    assert checked > 40


@pytest.mark.skipif(importlib.util.find_spec("grpc_tools") is None,
                    reason="grpcio-tools (a development tool) is not installed")
def test_the_committed_descriptor_sets_are_built_from_the_committed_protos():
    done = subprocess.run([sys.executable, str(PROTOS / "regenerate.py"), "--check"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


# -- requests --------------------------------------------------------------------------
def test_raw_and_typed_contents_decode_alike():
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    raw = service_pb2.ModelInferRequest()
    tensor(raw, "INPUT0", "FP32", [2, 4])
    raw.raw_input_contents.append(x.tobytes())
    typed = service_pb2.ModelInferRequest()
    tensor(typed, "INPUT0", "FP32", [2, 4]).contents.fp32_contents.extend(x.reshape(-1))
    for request in (raw, typed):
        req = decode(request)
        assert req.batch_size == 2
        np.testing.assert_array_equal(np.stack([i["INPUT0"] for i in req.items]), x)
        assert req.items[0]["INPUT0"].flags.writeable


@pytest.mark.parametrize("datatype, values", [
    ("FP16", np.array([1.5, -2, 0, 65504], np.float16)),
    ("INT8", np.array([-128, 0, 5, 127], np.int8)),
    ("UINT16", np.array([0, 1, 2, 65535], np.uint16)),
    ("INT64", np.array([-(2 ** 62), 0, 1, 2 ** 62], np.int64)),
    ("BOOL", np.array([True, False, False, True])),
    ("FP64", np.array([0.1, 0.2, -3, 1e300])),
])
def test_each_datatype_arrives_with_its_values(datatype, values):
    specs = (TensorSpec("INPUT0", datatype, (4,)),)
    r = service_pb2.ModelInferRequest()
    tensor(r, "INPUT0", datatype, [4])
    r.raw_input_contents.append(values.tobytes())
    got = decode(r, specs).inputs["INPUT0"]
    assert got.dtype == values.dtype
    np.testing.assert_array_equal(got, values)
    if datatype != "FP16":
        typed = service_pb2.ModelInferRequest()
        field = getattr(tensor(typed, "INPUT0", datatype, [4]).contents, CONTENTS_FIELD[datatype])
        field.extend(values.tolist())
        np.testing.assert_array_equal(decode(typed, specs).inputs["INPUT0"], values)


def test_bytes_inputs_raw_and_typed():
    specs = (TensorSpec("TEXT", "BYTES", (2,)),)
    raw = service_pb2.ModelInferRequest()
    tensor(raw, "TEXT", "BYTES", [2])
    raw.raw_input_contents.append(b"".join(len(b).to_bytes(4, "little") + b
                                           for b in (b"hi", b"\x00there")))
    typed = service_pb2.ModelInferRequest()
    tensor(typed, "TEXT", "BYTES", [2]).contents.bytes_contents.extend([b"hi", b"\x00there"])
    for request in (raw, typed):
        assert decode(request, specs).inputs["TEXT"].tolist() == [b"hi", b"\x00there"]


@pytest.mark.parametrize("build, expect", [
    (lambda r: tensor(r, "INPUT0", "FP32", [4]).contents.fp32_contents.extend([1, 2, 3]),
     "its shape needs 4 values, contents.fp32_contents holds 3"),
    (lambda r: tensor(r, "INPUT0", "FP32", [4]).contents.int_contents.extend([1, 2, 3, 4]),
     "a FP32 input's values go in contents.fp32_contents"),
    (lambda r: tensor(r, "INPUT0", "FP16", [4]).contents.fp32_contents.extend([1, 2, 3, 4]),
     "FP16 has no field in InferTensorContents; send its values in raw_input_contents"),
    (lambda r: (tensor(r, "INPUT0", "FP32", [4]), r.raw_input_contents.append(b"\0" * 15)),
     "4 FP32 values need 16 bytes, its raw_input_contents entry has 15"),
    (lambda r: (tensor(r, "INPUT0", "FP32", [4]), tensor(r, "X", "FP32", [1]),
                r.raw_input_contents.append(b"\0" * 16)),
     "1 raw_input_contents entries for 2 inputs"),
    (lambda r: (tensor(r, "INPUT0", "FP32", [4]).contents.fp32_contents.extend([1, 2, 3, 4]),
                r.raw_input_contents.append(b"\0" * 16)),
     "has values in contents while the request carries raw_input_contents"),
    (lambda r: tensor(r, "INPUT0", "FP32", [-4]),
     "'shape' must be a list of non-negative integers, got [-4]"),
    (lambda r: tensor(r, "INPUT0", "FP33", [4]), "datatype 'FP33' is not supported"),
    (lambda r: tensor(r, "INPUT0", "FP32", [5]).contents.fp32_contents.extend([0] * 5),
     "input 'INPUT0' must have shape [4], or [k, 4] for a batch of k items"),
    (lambda r: (tensor(r, "INPUT0", "FP32", [4]).contents.fp32_contents.extend([0] * 4),
                r.parameters["priority"].MergeFrom(service_pb2.InferParameter(string_param="1"))),
     "parameter priority='1' must be an integer"),
    (lambda r: (tensor(r, "INPUT0", "FP32", [4]).contents.fp32_contents.extend([0] * 4),
                r.parameters["timeout"].MergeFrom(service_pb2.InferParameter(int64_param=-5))),
     "parameter timeout=-5 must be a non-negative number of microseconds"),
    (lambda r: (tensor(r, "INPUT0", "FP32", [4]).contents.fp32_contents.extend([0] * 4),
                r.outputs.add(name="NOPE")), "unknown output 'NOPE'"),
    (lambda r: (tensor(r, "INPUT0", "FP32", [4]).contents.fp32_contents.extend([0] * 4),
                r.inputs[0].contents.int64_contents.extend([7] * 3)),
     "FP32 values go in contents.fp32_contents; contents.int64_contents must be empty"),
    (lambda r: (tensor(r, "INPUT0", "FP32", [4]).contents.fp32_contents.extend([0] * 4),
                r.outputs.add(name="OUTPUT0"), r.outputs.add(name="OUTPUT0")),
     "output 'OUTPUT0' is asked for more than once"),
    (lambda r: tensor(r, "INPUT0", "FP32", [4]).parameters["shared_memory_region"]
     .MergeFrom(service_pb2.InferParameter(string_param="region")),
     "shared-memory tensors ('shared_memory_region') are not supported"),
    (lambda r: None, "the request has no inputs"),
])
def test_a_bad_request_is_a_client_error_saying_what_to_send(build, expect):
    r = service_pb2.ModelInferRequest()
    build(r)
    with pytest.raises(ClientError) as info:
        decode(r)
    assert expect in info.value.message


def test_out_of_range_values_and_priorities():
    specs = (TensorSpec("INPUT0", "INT8", (1,)),)
    r = service_pb2.ModelInferRequest()
    tensor(r, "INPUT0", "INT8", [1]).contents.int_contents.append(300)
    with pytest.raises(ClientError, match="out of range for INT8"):
        decode(r, specs)
    r = service_pb2.ModelInferRequest()
    tensor(r, "INPUT0", "FP32", [4]).contents.fp32_contents.extend([0] * 4)
    r.parameters["priority"].uint64_param = 4
    with pytest.raises(ValidationError, match="priority 4 is out of range: send 1"):
        decode(r)


def test_scheduling_parameters_as_triton_clients_send_them():
    r = service_pb2.ModelInferRequest(id="req-1")
    tensor(r, "INPUT0", "FP32", [4]).contents.fp32_contents.extend([0] * 4)
    r.parameters["priority"].uint64_param = 1
    r.parameters["timeout"].int64_param = 2500
    req = decode(r)
    assert (req.priority, req.timeout_ms, req.id, req.batched) == (0, 2.5, "req-1", False)


# -- responses ---------------------------------------------------------------------------
def test_a_response_is_raw_and_reads_back_in_tritonclients_result():
    r = service_pb2.ModelInferRequest(id="x")
    tensor(r, "INPUT0", "FP32", [3, 4]).contents.fp32_contents.extend([0] * 12)
    req = decode(r)
    results = [{"OUTPUT0": np.full(4, i, np.float32)} for i in range(3)]
    response = encode_response("m", "1", req, results, OUT)
    back = InferResult(service_pb2.ModelInferResponse.FromString(response.SerializeToString()))
    np.testing.assert_array_equal(back.as_numpy("OUTPUT0"), np.repeat(np.arange(3.0), 4)
                                  .reshape(3, 4).astype(np.float32))
    assert back.get_response().id == "x"
    one = service_pb2.ModelInferRequest()
    tensor(one, "INPUT0", "FP32", [1, 4]).contents.fp32_contents.extend([0] * 4)
    shaped = encode_response("m", "1", decode(one), {"OUTPUT0": np.ones(4, np.float32)}, OUT)
    assert list(shaped.outputs[0].shape) == [1, 4]


def test_bytes_outputs_read_back_as_tritonclient_reads_them():
    specs = (TensorSpec("TEXT", "BYTES", (1,)),)
    r = service_pb2.ModelInferRequest()
    tensor(r, "TEXT", "BYTES", [1]).contents.bytes_contents.append(b"a")
    out = np.array([b"abc", b""], dtype=object)
    response = encode_response("m", "1", decode(r, specs, specs), {"TEXT": out}, specs)
    back = InferResult(service_pb2.ModelInferResponse.FromString(response.SerializeToString()))
    assert back.as_numpy("TEXT").tolist() == [b"abc", b""]


# -- status codes ------------------------------------------------------------------------
@pytest.mark.parametrize("error, code, retry", [
    (ModelNotFound("no such model"), grpc.StatusCode.NOT_FOUND, None),
    (ClientError("bad"), grpc.StatusCode.INVALID_ARGUMENT, None),
    (ValidationError("out of range"), grpc.StatusCode.INVALID_ARGUMENT, None),
    (QueueFull("full", retry_after_s=2.2), grpc.StatusCode.RESOURCE_EXHAUSTED, "3"),
    (RequestExpired("waited too long"), grpc.StatusCode.DEADLINE_EXCEEDED, None),
    (ShuttingDown("stopping"), grpc.StatusCode.UNAVAILABLE, None),
])
def test_errors_map_to_status_codes_with_their_messages(error, code, retry):
    answer = refusal(error, "test")
    assert (answer.code, answer.message) == (code, error.message)
    assert dict(answer.metadata).get("retry-after") == retry


def test_a_bug_is_internal_and_leaks_nothing(caplog):
    answer = refusal(KeyError("secret-detail"), "gRPC ModelInfer")
    assert answer.code is grpc.StatusCode.INTERNAL
    assert "secret-detail" not in answer.message and "logged on the server as" in answer.message
