"""``ModelInferRequest`` -> one checked request, model outputs -> ``ModelInferResponse``.

The gRPC side of the Open Inference Protocol codec. Pure functions, no I/O. Every
check after the wire format is the REST codec's own (``runtime.server.kserve``): the
same ``InferRequest``, the same shape, datatype and batch-dimension checks against
the model's ``TensorSpec``s, the same scheduling parameters (``priority`` 1 (most
urgent) .. ``priority_levels`` with 0 or absent for the default, ``timeout`` in
microseconds, as Triton's gRPC clients send them), and so the same error messages.

Input values come either in each input's typed ``contents`` (``fp32_contents``,
``int64_contents``, ``bytes_contents``, ...) or, for every input at once, in
``raw_input_contents`` (one entry per input, in order; little-endian values, and for
BYTES each element as a 4-byte little-endian length and its bytes), which is what
``tritonclient.grpc`` sends. FP16 has no typed field and travels raw only. Outputs go
back in ``raw_output_contents``, one entry per output, as Triton answers.

Shared-memory tensors (Triton's ``shared_memory_region`` parameters) and the
``classification`` output extension are refused with a message saying what to send.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np
from google.protobuf.message import Message

from runtime.api.errors import ClientError, RequestTooLarge
from runtime.api.model import DATATYPES, TensorSpec
from runtime.server.grpc.protocol import message
from runtime.server.bounds import MemoryBudget, RequestBounds
from runtime.server.kserve import (UNBOUNDED, InferRequest, Result, apply_requested_outputs,
                                   apply_scheduling, binary_data, bytes_from_binary,
                                   check_against_specs, check_declared, declared_bytes,
                                   response_tensors, shape_of)

#: the ``InferTensorContents`` field that carries each datatype's values (FP16: none)
CONTENTS_FIELD = {
    "BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents",
    "INT32": "int_contents", "INT64": "int64_contents", "UINT8": "uint_contents",
    "UINT16": "uint_contents", "UINT32": "uint_contents", "UINT64": "uint64_contents",
    "FP32": "fp32_contents", "FP64": "fp64_contents", "BYTES": "bytes_contents",
}
#: the most values one input may carry in typed ``contents`` (each becomes a Python
#: object while converted, on the event loop: about 50 ms a million)
MAX_CONTENTS_VALUES = 1 << 20
#: tensor parameters that point at memory this server cannot read
_SHARED_MEMORY = ("shared_memory_region", "shared_memory_byte_size", "shared_memory_offset")

ModelInferResponse = message("ModelInferResponse")


def parameters(params: Any) -> dict[str, Any]:
    """A ``map<string, InferParameter>`` as plain values (the one set in each)."""
    out = {}
    for key, param in params.items():
        choice = param.WhichOneof("parameter_choice")
        out[key] = None if choice is None else getattr(param, choice)
    return out


def _refuse_unsupported(params: Any, what: str) -> None:
    for key in params:
        if key in _SHARED_MEMORY:
            raise ClientError(f"{what}: shared-memory tensors ({key!r}) are not supported by "
                              "this server; send the values in the request itself "
                              "(contents or raw_input_contents)")
        if key == "classification":
            raise ClientError(f"{what}: the classification extension is not supported; ask "
                              "for the output itself and rank its values on the client")


def _from_raw(name: str, datatype: str, raw: bytes, count: int) -> np.ndarray:
    if datatype == "BYTES":
        return bytes_from_binary(name, raw, count)
    itemsize = np.dtype(DATATYPES[datatype]).itemsize
    if len(raw) != count * itemsize:
        raise ClientError(f"input {name!r}: {count} {datatype} values need {count * itemsize} "
                          f"bytes, its raw_input_contents entry has {len(raw)}")
    # a writable copy: torch.from_numpy warns on the read-only buffer of ``bytes``
    return np.frombuffer(bytearray(raw), dtype=DATATYPES[datatype])


def _from_contents(name: str, datatype: str, tensor: Message, count: int) -> np.ndarray:
    field = CONTENTS_FIELD.get(datatype)
    if field is None:
        raise ClientError(f"input {name!r}: {datatype} has no field in InferTensorContents; "
                          "send its values in raw_input_contents (as tritonclient does)")
    values = getattr(tensor.contents, field)
    if count > MAX_CONTENTS_VALUES:  # each value becomes a Python object on the way
        raise RequestTooLarge(f"input {name!r}: its shape needs {count} values, more than "
                              f"the {MAX_CONTENTS_VALUES} this server reads from typed "
                              "contents; send them in raw_input_contents (as tritonclient "
                              "does)")
    if len(values) != count:
        raise ClientError(f"input {name!r}: its shape needs {count} values, contents."
                          f"{field} holds {len(values)} (a {datatype} input's values go in "
                          f"contents.{field}, or every input's in raw_input_contents)")
    stray = [f.name for f, _ in tensor.contents.ListFields() if f.name != field]
    if stray:  # values beside the right ones: not silently dropped
        raise ClientError(f"input {name!r}: {datatype} values go in contents.{field}; "
                          f"contents.{stray[0]} must be empty")
    if datatype == "BYTES":
        arr = np.empty(count, dtype=object)
        arr[:] = list(values)
        return arr
    try:
        return np.fromiter(values, DATATYPES[datatype], count)
    except OverflowError:
        raise ClientError(f"input {name!r}: a value in contents.{field} is out of range "
                          f"for {datatype}") from None


def decode_request(request: Message, model: str, specs: Sequence[TensorSpec],
                   output_specs: Sequence[TensorSpec], priority_levels: int,
                   bounds: RequestBounds = UNBOUNDED,
                   budget: MemoryBudget | None = None) -> InferRequest:
    """Decode and check one ``ModelInferRequest`` for ``model``; raises ClientError or
    ValidationError, with the REST codec's messages wherever the two agree. As there,
    every input's declared shape is checked against its spec and ``bounds``, and the
    bytes of the arrays reserved in ``budget`` (``req.reservation``, released by the
    caller once answered), before any value is converted."""
    inputs = request.inputs
    if not inputs:
        raise ClientError("the request has no inputs; send one InferInputTensor (name, "
                          "datatype, shape and values) per model input")
    raw = request.raw_input_contents
    if raw and len(raw) != len(inputs):
        raise ClientError(f"the request has {len(raw)} raw_input_contents entries for "
                          f"{len(inputs)} inputs; send one per input, in the order of "
                          "'inputs', or none and every input's values in its contents")
    declared: list[tuple[str, str, tuple[int, ...], int]] = []
    seen: set[str] = set()
    items = 1
    for i, tensor in enumerate(inputs):
        name = tensor.name
        if not name:
            raise ClientError(f"inputs[{i}] needs a name")
        if name in seen:
            raise ClientError(f"input {name!r} appears more than once")
        seen.add(name)
        _refuse_unsupported(tensor.parameters, f"input {name!r}")
        shape = shape_of(name, list(tensor.shape))
        datatype = tensor.datatype
        if datatype not in DATATYPES:
            raise ClientError(f"input {name!r}: datatype {datatype!r} is not supported; use "
                              f"one of {', '.join(DATATYPES)}")
        items = max(items, check_declared(model, specs, name, shape, bounds))
        declared.append((name, datatype, shape, math.prod(shape)))
    reservation = None
    if budget is not None:
        reservation = budget.reserve(declared_bytes(
            [(datatype, count, len(raw[i]) if raw else request.ByteSize())
             for i, (_, datatype, _, count) in enumerate(declared)], items),
            f"this request to {model!r}")
    try:
        tensors: dict[str, np.ndarray] = {}
        datatypes: dict[str, str] = {}
        for i, (name, datatype, shape, count) in enumerate(declared):
            tensor = inputs[i]
            if raw:
                if tensor.HasField("contents"):
                    raise ClientError(f"input {name!r} has values in contents while the "
                                      "request carries raw_input_contents; send every "
                                      "input's values one way")
                arr = _from_raw(name, datatype, raw[i], count)
            else:
                arr = _from_contents(name, datatype, tensor, count)
            tensors[name] = arr.reshape(shape)
            datatypes[name] = datatype
        req = InferRequest(inputs=tensors, id=request.id or None)
        apply_scheduling(parameters(request.parameters), priority_levels, req)
        if request.outputs:
            for out in request.outputs:
                _refuse_unsupported(out.parameters, f"output {out.name!r}")
            apply_requested_outputs([{"name": out.name} for out in request.outputs],
                                    output_specs, req)
        check_against_specs(model, specs, tensors, datatypes, req)
    except BaseException:
        if reservation is not None:
            reservation.release()
        raise
    req.reservation = reservation
    return req


def encode_response(model: str, version: str, req: InferRequest, result: Result,
                    output_specs: Sequence[TensorSpec]) -> Message:
    """The ``ModelInferResponse`` of ``req``: every output asked for (default all) in
    ``raw_output_contents``. ``result`` is the one item's outputs, or the list of every
    item's outputs of a request of several items, stacked here in order."""
    response = ModelInferResponse(model_name=model, model_version=version, id=req.id or "")
    for out in response_tensors(model, req, result, output_specs):
        response.outputs.add(name=out.name, datatype=out.datatype, shape=out.shape)
        response.raw_output_contents.append(binary_data(out.array, out.datatype))
    return response
