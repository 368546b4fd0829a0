"""Open Inference Protocol (KServe v2 REST) codec: bytes <-> numpy tensors.

Pure functions, no I/O (the two engine calls of ``engine_calls`` aside). The request
side turns an ``/infer`` body (JSON, or JSON followed by raw tensor bytes when the client
uses the binary tensor extension) into one request's named numpy arrays plus its
scheduling parameters, checking every tensor against the model's ``TensorSpec``s. The
response side turns the model's output arrays back into a v2 response body.

The gRPC codec (``runtime.server.grpc.tensors``) decodes and encodes through the same
public functions (``shape_of``, ``bytes_from_binary``, ``apply_scheduling``,
``apply_requested_outputs``, ``check_against_specs``, ``response_tensors``,
``binary_data``), so both transports refuse the same requests with the same messages.

The parts:

    decode.py        parse_infer: an ``/infer`` body -> a checked ``InferRequest``
    compression.py   the body's Content-Encoding (gzip, deflate) undone, bounded
    inputs.py        one input: its declaration checked, then its values read
    request.py       InferRequest; scheduling parameters, outputs asked for, the specs
    encode.py        the outputs -> a v2 response body (JSON data or binary tensors)
    engine_calls.py  run_infer / submit_infer: a decoded request to the engine
"""

from runtime.server.kserve.compression import INFLATE_SLICE_BYTES, MAX_DECODED_BYTES, decoded_body
from runtime.server.kserve.decode import HEADER_LENGTH, UNBOUNDED, parse_infer
from runtime.server.kserve.encode import OutputTensor, binary_data, encode_infer, response_tensors
from runtime.server.kserve.engine_calls import run_infer, submit_infer
from runtime.server.kserve.inputs import (MAX_DIMS, MAX_ELEMENTS, bytes_from_binary, check_declared,
                                          declared_bytes, shape_of)
from runtime.server.kserve.request import (InferRequest, Result, apply_requested_outputs,
                                           apply_scheduling, check_against_specs)

__all__ = ["HEADER_LENGTH", "INFLATE_SLICE_BYTES", "InferRequest", "MAX_DECODED_BYTES", "MAX_DIMS",
           "MAX_ELEMENTS", "OutputTensor", "Result", "UNBOUNDED", "apply_requested_outputs",
           "apply_scheduling", "binary_data", "bytes_from_binary", "check_against_specs",
           "check_declared", "declared_bytes", "decoded_body", "encode_infer", "parse_infer",
           "response_tensors", "run_infer", "shape_of", "submit_infer"]
